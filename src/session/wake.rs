//! What wakes an operation blocked inside its session (so a cancel is seen at once); shared by
//! operations and the layer gates they wait on.

pub trait Waker: Send + Sync {
    fn wake(&self);
}
