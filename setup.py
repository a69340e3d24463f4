from setuptools import find_packages, setup

setup(
    name="puzzle-rlhf",
    version="0.1.0",
    description="PPO (RLHF) for LLaMA-class models on megatron-core, after the PUZZLE design (ATC'24)",
    python_requires=">=3.10",
    packages=find_packages(include=["puzzle", "puzzle.*", "megatron_patches", "megatron_patches.*"]),
    package_data={"puzzle": ["plan_search/profiles/*.json", "data/bundled/*.jsonl"]},
    py_modules=["train_ppo", "search_plan"],
    install_requires=[
        # megatron-core: the patches in megatron_patches/ are checked on these releases
        "megatron-core>=0.16.0,<0.17",
        "torch>=2.6",
        "numpy",
        "datasets",
        # needed by megatron-core but not declared by it (HyperCommGrid, static inference, dist-ckpt)
        "einops",
        "tqdm",
        "psutil",
    ],
    extras_require={
        # tensorboard: the --tensorboard-dir test reads the event files back
        # matplotlib: the plot tool's test draws a figure
        # peft: the LoRA export's test loads the exported adapter (it adds accelerate, pure Python)
        "test": ["pytest>=7", "pytest-timeout", "tensorboard", "matplotlib", "peft"],
        # never pulled by `test`: on a CPU machine the installable TE package breaks `import megatron.core`
        "gpu": ["transformer-engine[pytorch]"],
        "hf": ["transformers", "safetensors"],
        "tb": ["tensorboard"],
        # math answers checked by math-verify (else sympy) in puzzle.reward_functions.math_checker
        "math": ["math-verify"],
        "wandb": ["wandb"],
        # python -m puzzle.tools.plot: training curves from metrics.jsonl
        "plot": ["matplotlib"],
    },
)
