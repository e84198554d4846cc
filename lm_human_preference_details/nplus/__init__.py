"""The successor recipe (Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO", arXiv:2403.17031): what
it adds to OAI's and that OAI's recipe never runs: supervised fine-tuning, a critic of its own. Its spec is
docs/nplus-details.md; the scripts import this room, nothing in the package does."""
