from setuptools import setup

setup(
    name="turboquant-hf",
    version="0.1.0",
    description="TurboQuant weight quantization (tq3_native) for Hugging Face transformers",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=["turboquant_hf", "turboquant_hf.kernels", "turboquant_hf.model_cards"],
    package_dir={
        "turboquant_hf": "turboquant_hf",
        "turboquant_hf.kernels": "kernels",
        "turboquant_hf.model_cards": "model_cards",
    },
    package_data={"turboquant_hf.model_cards": ["*.jinja"]},
    install_requires=[
        "torch>=2.4",
        "transformers>=5.17,<6",
        "accelerate>=1.0",
        "safetensors>=0.4",
        "huggingface_hub>=1.0",
        "optimum>=1.20",
        "numpy",
        "jinja2",
        "tqdm",
        "pyyaml",
    ],
    extras_require={
        "gpu": ["triton>=3.2"],
        "peft": ["peft>=0.17"],
        "test": [
            "pytest>=8",
            "pytest-xdist>=3",  # the interpreter kernel tests on both cores
            # LoRA adapters on TurboQuant layers (turboquant_hf.lora)
            "peft>=0.17",
            "gguf>=0.10",
            "scipy",
            # the independent reference implementation of the format (pure Python, runs on CPU)
            "turboquant-plus-vllm==0.13.12",
            # the Triton kernels' tests run under TRITON_INTERPRET=1 on CPU
            "triton>=3.2",
        ],
    },
    entry_points={"console_scripts": ["turboquant-hf = turboquant_hf.cli:main"]},
)
