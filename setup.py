import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

# The start-up hook (turboquant_hf/turboquant_hf_autoload.py): a line Python runs from site-packages at start-up.
PTH_NAME = "turboquant_hf.pth"
PTH_LINE = "import turboquant_hf_autoload; turboquant_hf_autoload.install()\n"
# The package's folders, in the order of its layers (docs/architecture.md).
SUBPACKAGES = ["format", "modeling", "quantization", "calibration", "reporting", "integration", "conversion", "cli"]


class build_py_with_pth(build_py):
    """build_py, plus the start-up hook's .pth at the root of the build (so at the root of site-packages)."""

    def run(self):
        super().run()
        if not self.editable_mode:
            os.makedirs(self.build_lib, exist_ok=True)
            with open(os.path.join(self.build_lib, PTH_NAME), "w", encoding="utf-8") as f:
                f.write(PTH_LINE)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH_NAME)]


class editable_wheel_with_pth(editable_wheel):
    """An editable install's wheel holds only the import hooks of its strategy; the start-up hook's .pth is added
    to it beside them."""

    def _select_strategy(self, name, tag, build_lib):
        strategy = super()._select_strategy(name, tag, build_lib)

        class WithPth:
            def __enter__(self):
                strategy.__enter__()
                return self

            def __exit__(self, *exc):
                return strategy.__exit__(*exc)

            def __call__(self, wheel, files, mapping):
                strategy(wheel, files, mapping)
                wheel.writestr(PTH_NAME, PTH_LINE.encode("utf-8"))

        return WithPth()


setup(
    name="turboquant-transformers",  # (the import name is turboquant_hf, the command turboquant-hf)
    version="0.1.0",
    description="TurboQuant weight quantization (tq3_native) for Hugging Face transformers",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=["turboquant_hf", *(f"turboquant_hf.{sub}" for sub in SUBPACKAGES), "turboquant_hf.kernels",
              "turboquant_hf.model_cards"],
    py_modules=["turboquant_hf_autoload"],
    package_dir={
        "": "turboquant_hf",  # (the top-level start-up module lives in the package's folder)
        "turboquant_hf": "turboquant_hf",
        "turboquant_hf.kernels": "kernels",
        "turboquant_hf.model_cards": "model_cards",
    },
    package_data={"turboquant_hf.modeling": ["cpu_kernel.c"], "turboquant_hf.model_cards": ["*.jinja"]},
    cmdclass={"build_py": build_py_with_pth, "editable_wheel": editable_wheel_with_pth},
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
