"""The method's update in one place: parameter groups (per tower, per layer, with layer decay), LAMB with a
trust ratio per tensor, the optimizer built over them, the lr schedule and the temperature controller."""
