"""The worker processes from the controller's side: starting them (launch, attach, the warm zygote), knowing a model's
units before they start, and watching them until they stop or one fails."""
