"""The benchmarks ``python -m benchmarks.run`` knows, by name: a module each with ``run(quick, out_dir) -> dict``
(and, for the docs, ``headline(entry)``). Its own module so that the docs' generator reads it without importing the
runner, which calls the generator."""

# name -> module path. Modules are imported only when selected, so one benchmark's heavy or
# broken imports never stop the others from running.
REGISTRY: dict[str, str] = {
    "engine_throughput": "benchmarks.engine_throughput",
    "weight_sync": "benchmarks.weight_sync",
    "long_tail": "benchmarks.long_tail",
    "pipeline_overlap": "benchmarks.pipeline_overlap",
    "orchestration": "benchmarks.orchestration",
    "time_to_accuracy": "benchmarks.time_to_accuracy",
    "save_latency": "benchmarks.save_latency",
    "train_step": "benchmarks.train_step",
    "scale": "benchmarks.scale",
    "train_memory": "benchmarks.train_memory",
    "trl_peer": "benchmarks.trl_peer",
    "trl_peer_shapes": "benchmarks.trl_peer_shapes",
    "trl_peer_accuracy": "benchmarks.trl_peer_accuracy",
    "quickstart_speed": "benchmarks.quickstart_speed",
    "roofline": "benchmarks.roofline",
    "async_real": "benchmarks.async_real",
    "levers": "benchmarks.levers",
}
