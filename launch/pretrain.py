"""Pretrain a small GPT on the bundled World English Bible with SCAPE or a dense baseline.

Commands (on CPU ``--num_gpus`` is the number of ranks; the config chooses the optimizer)::

    deepspeed --num_gpus 2 launch/pretrain.py --deepspeed_config ds_configs/scape_dct.json
    deepspeed --num_gpus 2 launch/pretrain.py --deepspeed_config ds_configs/dense_adamw.json
    deepspeed --num_gpus 2 launch/pretrain.py --deepspeed_config ds_configs/scape_zero3.json  # ZeRO-3, basis dct
    deepspeed --num_gpus 2 launch/pretrain.py --deepspeed_config ds_configs/scape_zero3_replica.json  # + replica
    deepspeed --num_gpus 2 launch/pretrain.py --deepspeed_config ds_configs/scape_zero3_coordinate.json
    python launch/pretrain.py --deepspeed_config ds_configs/scape_dct.json          # one rank
    mpiexec -n 4 python launch/pretrain.py --deepspeed_config ds_configs/scape_mpi.json   # MPI launch
    deepspeed --num_gpus 4 launch/pretrain.py --deepspeed_config ds_configs/scape_megatron.json \
        --tensor-model-parallel-size 2            # TP2 x DP2, megatron-core layers, SCAPE over DP
    deepspeed --num_gpus 4 launch/pretrain.py --deepspeed_config ds_configs/scape_megatron.json \
        --pipeline-model-parallel-size 2          # PP2 x DP2, DeepSpeed's PipelineEngine
    # scape_mpi.json, scape_megatron.json: basis "dct" (scape_dct.json's exchange); their
    # every *_coordinate.json: the coordinate basis
    deepspeed --hostfile hosts --num_gpus 8 launch/pretrain.py --deepspeed_config ds_configs/scape_hier.json

Steps: parse and check every input (config, corpus, --load) before any process group exists, so
bad input is one line on stderr and a non-zero exit; start torch.distributed; build the data, the
model (scape_ds.models, single-device code) and the engine (scape_ds.initialize); optionally load a
checkpoint; train with a progress bar, a log line every --log-interval steps and validation every
--eval-interval steps; save; print the bytes SCAPE sent against the dense exchange. The loop lives in
scape_ds/train.py (``python -m scape_ds.train`` is the same program). A lost peer (a dropped link, a
dead node) ends every rank within --dist-timeout plus a few seconds, exit code 3, with one line naming
the silent rank and the checkpoint to resume from with --load (scape_ds/faults.py). SIGTERM or
SIGINT to the `deepspeed` command (or its end) stops every rank after the current step, which is
saved with --save; one line names the tag, exit code 143 (scape_ds/stop.py). Exit codes: docs/checkpoints.md,
"Checkpoints and failure semantics".
"""
from scape_ds.train import run

if __name__ == "__main__":
    run()  # main(), then os._exit: see scape_ds.train.run
