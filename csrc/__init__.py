"""Data folder shipped inside the flashrt wheel (see setup.py): the csrc CUDA sources."""
