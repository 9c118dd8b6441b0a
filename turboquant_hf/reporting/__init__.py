"""What a model or a saved folder amounts to: `model_shape` (what config.json says beyond the weights), `sizing`
(exact sizes and memory plans before loading), `card` (the model card) and `evaluation` (quality on real text)."""
