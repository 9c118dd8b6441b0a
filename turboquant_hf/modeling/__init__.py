"""The quantized modules and the torch operators they call: `modules` (TurboQuantLinear, TurboQuantExperts),
`ops` (the `turboquant::*` operators and their torch reference), `cpu_kernel` (the compiled CPU product),
`activations`, `routing` and `experts_layout` (what the experts op needs to know of transformers' MoE modules).
The GPU implementations of the operators are `turboquant_hf.kernels`."""
