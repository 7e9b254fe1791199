"""On-disk and in-arena layouts: file specs, the torch.save-compatible zip writer, safetensors files."""
from .specs import Concat, MemoryOnly, RawBytes, TorchSave, safetensors_file

__all__ = ["Concat", "MemoryOnly", "RawBytes", "TorchSave", "safetensors_file"]
