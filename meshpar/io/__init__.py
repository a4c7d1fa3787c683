"""Layer 3, io: state in and out of files.

checkpoint  Orbax checkpoints: async save, restore onto any mesh, damaged-checkpoint fallback
hf          Hugging Face safetensors import/export (the model says how its parameters map)
tokenizer   byte-level and `tokenizers` text <-> ids
"""
