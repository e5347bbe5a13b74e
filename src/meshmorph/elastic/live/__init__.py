"""Live execution of a reshape: the node-local store, state taken out of and put into engines, the
MovePlan's transfers, and the controller under torchrun's elastic agent."""
