"""Hugging Face Trainer integration (public face: :mod:`snapckpt.hf`). Importing this package does not
import transformers: the file builders in :mod:`.files` are shared with the Accelerate integration."""
