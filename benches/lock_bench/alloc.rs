//! Heap accounting for the memory scenario (e) and the counts (h): a global allocator that
//! forwards to `System` and, once [`COUNTING`] is on, keeps the bytes currently allocated and
//! the allocations made (and their bytes) so far.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::atomic::{AtomicBool, AtomicIsize, AtomicU64, Ordering},
};

struct CountingAlloc;

static HEAP_BYTES: AtomicIsize = AtomicIsize::new(0);
/// Allocations made (`alloc`, `alloc_zeroed`, `realloc`), and the bytes each asked for.
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static ALLOCATED_BYTES: AtomicU64 = AtomicU64::new(0);

fn counted(bytes: usize) {
    ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    ALLOCATED_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
}

/// Off until the memory scenario (e) starts, and on from then: one shared counter updated by
/// every allocation would slow the timed scenarios down, allocation-heavy code (the layer, more
/// than the hand-written baselines) the most, as both runtime workers contend for its cache
/// line.
pub(crate) static COUNTING: AtomicBool = AtomicBool::new(false);

// SAFETY: every call is forwarded unchanged to `System`; the wrapper only adds up sizes.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, passed on as is.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() && COUNTING.load(Ordering::Relaxed) {
            HEAP_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
            counted(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() && COUNTING.load(Ordering::Relaxed) {
            HEAP_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
            counted(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout` (every allocation goes there).
        unsafe { System.dealloc(ptr, layout) };
        if COUNTING.load(Ordering::Relaxed) {
            HEAP_BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as for `dealloc`, and the caller upholds `realloc`'s contract.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() && COUNTING.load(Ordering::Relaxed) {
            HEAP_BYTES.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
            counted(new_size);
        }
        new
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

/// The bytes allocated now, counted from when [`COUNTING`] was turned on.
pub(crate) fn heap_bytes() -> i64 {
    HEAP_BYTES.load(Ordering::SeqCst) as i64
}

/// Allocations made since counting was turned on, and the bytes they asked for (a `realloc`
/// counts as one, of its new size).
pub(crate) fn allocations() -> (u64, u64) {
    (
        ALLOCATIONS.load(Ordering::SeqCst),
        ALLOCATED_BYTES.load(Ordering::SeqCst),
    )
}
