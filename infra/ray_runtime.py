"""Starting or joining Ray for the service.

Contract:
- `start_ray(settings)` joins `settings.ray_address` when set (a cluster: `ray://head:10001`, `auto`, or
  `host:6379`), else starts a small local Ray: `num_cpus=settings.ray_num_cpus`, an object store of
  `settings.ray_object_store_bytes`, no dashboard, `RAY_AUTH_MODE=disabled`, node IP 127.0.0.1, and its
  temp dir under the runtime dir (not the user's home). If Ray is already initialised in this process
  (tests share one instance) it is reused and left running by `stop()`.
- The returned `RayRuntime` says whether this call initialised Ray in this process (`owned`); `stop()` then
  shuts it down, which stops a local Ray and merely disconnects from a cluster.
- Local Ray's unix sockets live under the temp dir, whose path must stay short (Linux: 107 bytes per
  socket path); a runtime dir deeper than `MAX_TEMP_DIR_LEN` gets a short directory under /tmp instead.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from infra.config import Settings

log = logging.getLogger(__name__)

NAMESPACE = "vidspec"
MAX_TEMP_DIR_LEN = 40  # Ray appends ~65 characters (session_<date>_<pid>/sockets/plasma_store)

# Environment every Ray worker of the service needs: offline Hugging Face, fast GQA attention on CPU.
WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TRANSFORMERS_SDPA_FORCE_GQA": "1",
    "RAY_AUTH_MODE": "disabled",
}


class RayStartError(RuntimeError):
    """Ray could not be started or joined."""


@dataclass
class RayRuntime:
    address: str
    owned: bool  # True: this call ran ray.init, and stop() runs ray.shutdown
    temp_dir: Path | None = None

    def stop(self) -> None:
        import ray

        if self.owned and ray.is_initialized():
            ray.shutdown()
            self.owned = False


def ray_temp_dir(runtime_dir: Path) -> Path:
    path = (runtime_dir / "ray").resolve()
    if len(str(path)) > MAX_TEMP_DIR_LEN:
        path = Path(tempfile.gettempdir()) / f"vidspec-ray-{os.getuid()}"
        log.info("runtime dir is too deep for Ray's unix sockets; using %s for Ray's temp dir", path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def start_ray(settings: Settings, temp_dir: Path | None = None, log_to_driver: bool = True) -> RayRuntime:
    for k, v in WORKER_ENV.items():  # inherited by a local Ray's workers; sent to a cluster's below
        os.environ.setdefault(k, v)
    import ray

    if ray.is_initialized():
        ctx = ray.get_runtime_context()
        return RayRuntime(address=str(ctx.gcs_address), owned=False)
    if settings.ray_address:
        try:
            ctx = ray.init(
                address=settings.ray_address,
                namespace=NAMESPACE,
                runtime_env={"env_vars": dict(WORKER_ENV)},
                logging_level=logging.WARNING,
                log_to_driver=log_to_driver,
            )
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RayStartError(
                f"cannot join the Ray cluster at VIDSPEC_RAY_ADDRESS={settings.ray_address!r}: {exc}"
            ) from exc
        info = getattr(ctx, "address_info", None) or {}  # a ray:// client context has none
        return RayRuntime(address=str(info.get("gcs_address", settings.ray_address)), owned=True)
    tmp = temp_dir or ray_temp_dir(settings.runtime_dir)
    try:
        ctx = ray.init(
            num_cpus=settings.ray_num_cpus,
            num_gpus=None,
            object_store_memory=settings.ray_object_store_bytes,
            include_dashboard=False,
            namespace=NAMESPACE,
            _temp_dir=str(tmp),
            _node_ip_address="127.0.0.1",
            logging_level=logging.WARNING,
            log_to_driver=log_to_driver,
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise RayStartError(f"cannot start a local Ray (temp dir {tmp}): {exc}") from exc
    return RayRuntime(address=str(ctx.address_info["gcs_address"]), owned=True, temp_dir=tmp)
