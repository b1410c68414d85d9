"""Vision-language models: image references and how they load (``images``), the model's processor without
torchvision (``processor``), and Qwen2-VL's 3-D rotary positions that the engine and the trainer share (``rope``)."""
