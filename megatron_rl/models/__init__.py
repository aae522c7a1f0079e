"""Model architectures as data (`spec`), the trainer's and generators' parallel layouts, the one Megatron <->
HF <-> SGLang weight mapping, block FP8, HF reference models and streaming safetensors I/O."""
