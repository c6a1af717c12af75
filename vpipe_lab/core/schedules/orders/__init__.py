"""The published orders behind the schedule kinds: interleaved 1F1B's, ZB-H1's, ZBV's, PipeDream's weight versions, and
what a stage holds along an order."""
