"""Everything about lucidrains' DALLE-pytorch 1.6: its flags (flags.py), its weights and checkpoints
(weights.py), its default pretrained tokenizers' downloads (downloads.py)."""
