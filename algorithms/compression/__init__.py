"""Communication compression: codecs (:mod:`.codecs` is the one import point), their
vectorized kernels, the count sketch, and the error-feedback memory. No Flower here; a
codec's output is a :class:`fedswarm.payload.Payload`."""
