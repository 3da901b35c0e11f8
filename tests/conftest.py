# --- worker/attention (tests/test_attention.py): Triton without a GPU ----------
# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when
# worker.attention.triton_decode is first imported, so it is set here, before
# any test module loads. Without an NVIDIA driver the kernel can only run in the
# interpreter (on CPU tensors); with one, the real compiler stays on.
import os as _os  # noqa: E402

if not _os.path.exists("/proc/driver/nvidia/version"):
    _os.environ.setdefault("TRITON_INTERPRET", "1")
# --- end worker/attention block ------------------------------------------------
