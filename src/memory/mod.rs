//! Agent memory: recorded episodes, the prompt protocols that render (episode, allocation) into chat
//! messages, allocation policies and the learned restoration selector. Nothing here touches device
//! buffers: memory talks to the engine through prompts and scores.

pub mod episode;
pub mod policy;
pub mod protocol;
pub mod selector;
pub mod selector_labels;
pub mod selector_train;
