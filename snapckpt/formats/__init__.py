"""On-disk and in-arena layouts: file specs, the torch.save-compatible zip writer, safetensors files."""
from snapckpt.formats.specs import Concat, MemoryOnly, RawBytes, TorchSave, respec, safetensors_file

__all__ = ["Concat", "MemoryOnly", "RawBytes", "TorchSave", "respec", "safetensors_file"]
