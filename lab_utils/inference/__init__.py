"""Lab 03, by concern: ``model_zoo`` (the digits CNN and the ResNet-50 the lab measures), ``onnx`` (export,
checks, ONNX Runtime), ``quantize`` (ModelOpt AutoCast and Q/DQ), ``tensorrt`` (engines, profiles, trtexec),
``torch_paths`` (eager, autocast, torch.compile, CUDA graphs) and ``compare`` (the one comparison table)."""
