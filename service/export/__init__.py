"""Exports of a trained model for other runtimes: the learned map as an ONNX graph
(:mod:`service.export.onnx_map`; ``nca-export MODEL --onnx FILE``). Imports numpy, onnx and
``service.core`` only, so the training package may use it too (``NCA.to_onnx``)."""
