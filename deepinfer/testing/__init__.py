"""Stand-ins for tests and benchmarks, never a production path: nothing under deepinfer.engine,
deepinfer.grammar or deepinfer.lang imports this package.

- `simulated_device.SimulatedDevice`: a model-runner stand-in whose step takes a set wall time
  without using the CPU (its result is ready after T, as on a CUDA stream);
- `simulated_engine.simulated_engine`: an `Engine` built from the default model's tokenizer and
  config with that stand-in as its runner, so the engine's own host work runs for real around it.
"""
