"""Stage 2: imitation learning of keyboard-and-mouse control: ``experiments.train`` with the imitation
config (default: the tiny CPU variant).

    python -m experiments.imitation                                   # tiny: recorded game demos, minutes
    python -m experiments.imitation --config=experiments/configs/imitation.py:pickaxe   # + wooden_pickaxe's
    python -m experiments.imitation --config=experiments/configs/imitation.py:qwen7b \\
        --config.model.hf_path=/path/to/Qwen2.5-VL-7B-Instruct --config.data.train_dirs=/mnt/d/a,/mnt/d/b \\
        --config.init_from=/path/to/world_knowledge_workdir --workdir=/path/to/run
"""

if __name__ == "__main__":
    from experiments.train import run

    run("imitation.py:tiny")
