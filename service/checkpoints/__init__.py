"""Checkpoints the project writes: deterministic random ones in the published Kimi-K3 layout
(`make.py`), the embedded default built from them once per user (`default.py`), and MXFP4
conversion of a bf16 checkpoint (`quantize.py`)."""
