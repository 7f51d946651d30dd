//! In-memory fakes of the store traits (tests only).
