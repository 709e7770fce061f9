"""Triton kernels only (@triton.jit code and their minimal launch helpers); nothing here imports
torch.distributed or other packages of this project."""

__project__ = "tp-overlap"  # checked by overlap/_install.py
