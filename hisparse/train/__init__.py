"""Training a tiny ML4 that retrieves passkeys (`hisparse train-needle`): the task, the autograd forward, the loop."""
