"""Lab 03: ONNX export and ONNX Runtime, torch inference paths, quantization, TensorRT engines, the comparison."""
