"""Pure loss functions: tensors in, ``(loss, metrics)`` out; no trainer or module access."""
