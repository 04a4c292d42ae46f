"""A DQN-style reinforcement-learning loop in the pattern of RL programs: a hand-rolled cart-pole environment stepped
on the host, a Q-network on the GPU chosen from by epsilon-greedy rollouts under `torch.no_grad()`, a replay buffer
on the host, and `--learning-starts` environment steps before the first optimizer step (thousands of small
forward passes, each a handful of ops, before training begins)."""

import argparse
import math
import random

import torch
from torch import nn


class CartPole:
    """Classic cart-pole dynamics (Euler steps), in plain Python: the environment is the program's own host work."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.state = self.reset()

    def reset(self) -> list[float]:
        self.state = [self.rng.uniform(-0.05, 0.05) for _ in range(4)]
        return self.state

    def step(self, action: int) -> tuple[list[float], float, bool]:
        x, x_dot, theta, theta_dot = self.state
        force = 10.0 if action == 1 else -10.0
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + 0.05 * theta_dot ** 2 * sin) / 1.1
        theta_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos ** 2 / 1.1))
        x_acc = temp - 0.05 * theta_acc * cos / 1.1
        self.state = [x + 0.02 * x_dot, x_dot + 0.02 * x_acc, theta + 0.02 * theta_dot, theta_dot + 0.02 * theta_acc]
        done = abs(self.state[0]) > 2.4 or abs(self.state[2]) > 0.2095
        return self.state, 1.0, done


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--learning-starts", type=int, default=500)
    parser.add_argument("--steps", type=int, default=520)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    device = torch.device("cuda")
    q_network = nn.Sequential(nn.Linear(4, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 2)).to(device)
    target = nn.Sequential(nn.Linear(4, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 2)).to(device)
    target.load_state_dict(q_network.state_dict())
    optimizer = torch.optim.Adam(q_network.parameters(), lr=2.5e-4)
    env, buffer, rng = CartPole(seed=1), [], random.Random(2)
    obs = env.reset()
    for step in range(args.steps):
        epsilon = max(0.05, 1.0 - step / 500)
        with torch.no_grad():  # the greedy action every step, as a vectorised rollout computes it
            q_values = q_network(torch.tensor(obs, device=device).unsqueeze(0))
            action = int(torch.argmax(q_values, dim=1).item())
        if rng.random() < epsilon:
            action = rng.randrange(2)
        next_obs, reward, done = env.step(action)
        buffer.append((obs, action, reward, next_obs, done))
        obs = env.reset() if done else next_obs
        if step < args.learning_starts:
            continue
        batch = rng.sample(buffer, args.batch_size)
        observations = torch.tensor([b[0] for b in batch], device=device)
        actions = torch.tensor([b[1] for b in batch], device=device)
        rewards = torch.tensor([b[2] for b in batch], device=device)
        next_observations = torch.tensor([b[3] for b in batch], device=device)
        dones = torch.tensor([float(b[4]) for b in batch], device=device)
        with torch.no_grad():
            target_max = target(next_observations).max(dim=1).values
            td_target = rewards + 0.99 * target_max * (1 - dones)
        old_values = q_network(observations).gather(1, actions.unsqueeze(1)).squeeze(1)
        loss = nn.functional.mse_loss(td_target, old_values)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
