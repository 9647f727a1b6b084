"""What the tests give ``head_optimizer`` for SGD only: its momentum (AdamW refuses SGD's settings)."""

#: ``head_optimizer(head, name, ..., **SGD_MOMENTUM[name])``: momentum 0.9 for SGD, nothing for AdamW.
SGD_MOMENTUM = {"sgd": {"momentum": 0.9}, "adamw": {}}
