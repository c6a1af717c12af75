"""Changing a running pipeline: live plan, partition, policy and model changes, the online replanner, the profile the
planners read, and plans taken out of the lab or brought into it."""
