"""Native CPU kernels, built for the host at first use (native.py)."""
