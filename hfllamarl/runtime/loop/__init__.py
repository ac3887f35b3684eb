"""The loop and its channels: tick/batch/step arithmetic (schedule), point-to-point and collective sends
(channels), the executor interface, what crosses the rollouts channel (rollout, sampling), the policy_weights
channel (weights_channel), who generates what (dispatch) and the controller every process runs (controller).
Imports only `world`."""
