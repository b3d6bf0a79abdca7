# search on a model that IS one Linear: refused with a self-contradictory message
import torch, torch.nn.functional as F
from torch import nn
import mixprec
torch.manual_seed(0)
x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
for model in (nn.Linear(16, 4), nn.Sequential(nn.Linear(16, 4))):
    try:
        rep = mixprec.search(model, [(x, y)], F.cross_entropy, budget={"memory": 0.5}, baseline="32-true", reps=1)
        print(type(model).__name__, "->", rep.plan)
    except Exception as e:
        print(type(model).__name__, "->", type(e).__name__, e)
