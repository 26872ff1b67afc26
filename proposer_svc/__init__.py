"""Draft proposers (pure algorithms) and the Proposer gRPC servicer."""
