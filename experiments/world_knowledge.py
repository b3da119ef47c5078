"""Stage 1: world-knowledge injection (VQA and captions): ``experiments.train`` with the world-knowledge
config; its workdir initialises imitation.

    python -m experiments.world_knowledge                 # tiny, synthetic VQA, a few minutes
    python -m experiments.world_knowledge --config=experiments/configs/world_knowledge.py:qwen7b \\
        --config.model.hf_path=/path/to/Qwen2.5-VL-7B-Instruct --config.data.train_dirs=/mnt/d/a,/mnt/d/b \\
        --workdir=/path/to/wk_run
    python -m experiments.imitation --config.init_from=/path/to/wk_run ...   # then stage 2
"""

if __name__ == "__main__":
    from experiments.train import run

    run("world_knowledge.py:tiny")
