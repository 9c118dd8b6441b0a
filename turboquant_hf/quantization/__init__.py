"""What to quantize and how: `config` (TurboQuantConfig, CalibrationConfig), `recipes` (named configs) and
`planning` (the typed per-module plan built from a config, a checkpoint or an MLX layout)."""
