"""`python -m decoders.kernels`: build the native kernels for this CPU."""

import sys

from decoders.kernels import main

sys.exit(main())
