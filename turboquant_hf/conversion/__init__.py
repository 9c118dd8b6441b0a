"""Offline conversion without holding the model: `streaming` (StreamingQuantizer, tensor by tensor) and
`mlx_conversion` (turboquant-mlx models requantized to tq3_native)."""
