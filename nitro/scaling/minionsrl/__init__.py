"""MinionsRL (AAAI'24), the learned actor scheduler the paper measures Nitro against (§8.3), as
its scheduler code defines it: ``state`` (the MDP), ``policy`` (network and meta-PPO),
``simulator`` (the cheap training run it is pre-trained on), ``pretrain`` (training and the
scheduler file). The scaler that deploys it is ``nitro.scaling.scalers.MinionsRLScaler``."""
