"""The weight path: how the trainer's weights reach the inference engines after each update.

- ``update.py``: ``WeightUpdate``, the record of one update (version, route, dtype, targets, ...).
- ``source.py``: what each training backend implements once, its HF-named tensors and which rank sends them;
  ``iter_buckets`` groups them for the routes, on the tensors' own device (GPU weights stay on the GPU).
- One module per route, each the trainer's side of it (the engines' side is their client's HTTP calls):
  ``http.py`` (tensor buckets over HTTP, the embedded engine on another node), ``shared_memory.py`` (an engine
  on the trainer's node: the embedded engine maps a /dev/shm staging buffer, ``staging.py``, staged while it
  generates and committed in the pause; SGLang gets CUDA IPC handles for GPU weights, shared-memory files for
  CPU ones), ``disk.py`` (an HF folder the engines load), ``process_group.py`` (a broadcast in a process group
  with SGLang's ranks: NCCL straight from the GPU, gloo on the CPU).
- ``node.py``: whether an engine's URL is on this node (the shared-memory route's precondition).
- ``sender.py``: the trainer's rank 0 pushes buckets by the record's route.
- ``driver.py``: one update end to end, over the train group and the inference controller (the only module
  here that orchestrates Ray actors; backends import the others).
"""
