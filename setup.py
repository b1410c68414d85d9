from pathlib import Path

from setuptools import find_packages, setup


def _requirements(name: str) -> list[str]:
    lines = Path(__file__).with_name(name).read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


setup(
    name="miles_async",
    version="0.1.0",
    description="Asynchronous RL post-training of LLMs: Ray actors, SGLang/vLLM/embedded engines, torch and Megatron",
    packages=find_packages(include=["miles_async", "miles_async.*"]),
    py_modules=["train_async"],
    # The SGLang CPU engine's stand-ins are a PYTHONPATH folder for the engine's interpreter, not a
    # package of ours (no __init__.py), so find_packages does not see them.
    package_data={
        "miles_async.inference.sglang": ["cpu_shims/*.py", "cpu_shims/*/*.py"],
        "miles_async.inference.vllm": ["cpu_shims/*.py"],
    },
    # asyncio.TaskGroup, ExceptionGroup and Task.cancelling() are 3.11's.
    python_requires=">=3.11",
    # torch is left to the user (CPU or CUDA build); scripts/setup_env.sh installs the CPU wheel.
    install_requires=_requirements("requirements.txt"),
    extras_require={
        "test": _requirements("requirements-test.txt"),
        "megatron": ["megatron-core>=0.16.1"],
        "vllm": ["vllm>=0.11"],
        "sglang": ["sglang>=0.5"],
        "wandb": ["wandb>=0.19"],
    },
    entry_points={"console_scripts": ["miles-async-train=train_async:cli"]},
)
