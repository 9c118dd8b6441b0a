"""The transformers integration: `registration`, `quantizer` (the loader hooks), `loading`, `saving`, `patches`
(every replaced attribute), `lora` (PEFT), `tensor_parallel`, `offload` (accelerate), `dequantization`, `fusion`
(sibling projections as one op) and `mlx` (turboquant-mlx checkpoints read into TurboQuant modules)."""
