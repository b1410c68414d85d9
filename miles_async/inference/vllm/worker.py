"""Runs inside vLLM's worker processes (``--worker-extension-cls``), in vLLM's environment: import nothing
from this project and nothing vLLM does not have.

``reload_hf_weights`` is ``reload_weights`` (vLLM's in-place reload from a folder of HF safetensors) plus
one repair. vLLM 0.32 reloads layer by layer and, for a layer the checkpoint has no tensor for, puts its
old tensors back. A tied LM head (``tie_word_embeddings``: SmolLM2, Qwen3 up to 4B, the tiny test model)
has none, since its weight is the embedding's, so after a reload the head keeps the old embedding while
the input embedding takes the new one: the engine then samples from a model that never existed (found
by comparing the engine's log-probs with the trainer's after a reload). The repair ties the head to the
reloaded embedding again and redoes its post-load processing (on the CPU: the packed GEMM built from it).
"""

from __future__ import annotations


class MilesWorkerExtension:
    def reload_hf_weights(self, weights_path: str) -> dict:
        self.model_runner.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        config = getattr(model, "config", None)
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        retied = False
        if getattr(config, "tie_word_embeddings", False) and head is not None and embed is not None:
            if head.weight is not embed.weight:
                head.weight = embed.weight
                retied = True
            method = getattr(head, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(head)
        return {"retied_lm_head": retied}
