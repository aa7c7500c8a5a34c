"""Capture and replay: a Trainer step on the GPU recorded once as a CUDA graph and replayed per batch.

Why: the eager CuPy step is hundreds of small launches, each costing microseconds of Python and driver
time; on small models that, not the arithmetic, sets the step time. The step itself is not here: it is
Trainer._device_step, the same code the eager path runs (every layer's kernels from train/layers.py,
the loss, amp's unscaling and loss scale, the norm, clipping and the optimizer), written so that it
reads only fixed buffers (StepInputs: inputs, targets, learning rate and dropout keys as device
arrays) and never syncs with the host. So it can be recorded with CuPy stream capture:

  step 1   runs eagerly on this object's stream with its private memory pool: kernels compile, cuBLAS
           loads, and the pool fills with exactly the temporaries one step allocates;
  step 2   is captured (relaxed mode) with the same pool, then launched; the captured temporaries are
           blocks of the private pool, which nothing outside the graph can be given while it lives;
  later    stage the inputs (a pinned copy on the stream), launch the graph.

Every GEMM goes through runtime/cuda/blas.py (CuPy's own cuBLAS calls refuse capture). A failure to
capture or launch returns False after one log line; the Trainer then runs eagerly (capture runs no
work, so nothing is lost). The stream is ordered after the default stream (the batch was made there)
and the default stream after it (what follows sees the step's results).
"""

from __future__ import annotations


class CapturedStep:
    def __init__(self, cupy, log):
        self.cupy, self.log = cupy, log
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.pool = cupy.cuda.MemoryPool()
        self.graph = None
        self.steps_run = 0

    def run(self, stage, body) -> bool:
        """One step: stage() then body() eagerly (first call), captured (second), or a replay. False when
        capture or launch failed (said once in the log); the caller then runs the step eagerly."""
        cupy = self.cupy
        default = cupy.cuda.get_current_stream()
        self.stream.wait_event(default.record())
        try:
            with self.stream, cupy.cuda.using_allocator(self.pool.malloc):
                stage()
                if self.steps_run == 0:
                    body()
                else:
                    if self.graph is None:
                        self.graph = self._capture(body)
                    try:
                        self.graph.launch(self.stream)
                    except Exception as err:
                        raise CaptureFailure(f"graph launch failed: {_one_line(err)}") from None
        except CaptureFailure as err:
            self.log(f"cuda graph: {err}; training continues eagerly")
            return False
        finally:
            default.wait_event(self.stream.record())
        self.steps_run += 1
        return True

    def _capture(self, body):
        cupy = self.cupy
        self.stream.begin_capture(cupy.cuda.runtime.streamCaptureModeRelaxed)
        try:
            body()
        except Exception as err:
            try:
                self.stream.end_capture()
            except Exception:            # noqa: BLE001 - the capture is already invalid; report the first error
                pass
            raise CaptureFailure(f"capture failed: {_one_line(err)}") from None
        try:
            return self.stream.end_capture()
        except Exception as err:
            raise CaptureFailure(f"end of capture failed: {_one_line(err)}") from None


class CaptureFailure(Exception):
    """The step cannot be captured or replayed; the message is one line saying why."""


def _one_line(err: Exception) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}"[:300]
