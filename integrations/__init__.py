"""Framework adapters (DeepSpeed, Megatron, transformers, accelerate), installed as snapckpt.integrations.

Each adapter maps a framework onto the core's hooks and formats and depends on the core, never the reverse.
"""
