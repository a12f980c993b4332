"""Stand-in for Megatron-LM's ``tests/unit_tests/test_utilities.py``, written for mlarope.

Only what ``tests/unit_tests/fusions/test_mla_yarn_rope_apply.py`` uses: ``Utils``'s
``initialize_model_parallel`` and ``destroy_model_parallel``, on a one-process
``torch.distributed`` group (NCCL with a GPU, gloo without; an in-memory store, so parallel
test processes never share a port or a file). ``scripts/megatron_tests.py`` copies it to where
``tests.unit_tests.test_utilities`` resolves, in a scratch folder outside Megatron-LM's tree.
"""

from __future__ import annotations

import torch


class Utils:
    world_size = 1
    rank = 0

    @staticmethod
    def initialize_distributed() -> None:
        if torch.distributed.is_initialized():
            return
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        store = torch.distributed.HashStore()
        torch.distributed.init_process_group(backend, store=store, rank=0, world_size=1)

    @staticmethod
    def initialize_model_parallel(
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: int | None = None,
        **kwargs,
    ) -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        Utils.initialize_distributed()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size,
            **kwargs,
        )

    @staticmethod
    def destroy_model_parallel() -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
