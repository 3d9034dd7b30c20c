pub(crate) mod ucx;
